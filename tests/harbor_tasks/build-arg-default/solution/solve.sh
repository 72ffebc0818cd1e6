#!/bin/bash
cp /etc/app-version /app/version.txt
