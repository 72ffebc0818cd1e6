#!/bin/bash
echo checked >> /app/log.txt
