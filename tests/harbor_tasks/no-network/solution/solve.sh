#!/bin/bash
echo isolated > /app/net.txt
