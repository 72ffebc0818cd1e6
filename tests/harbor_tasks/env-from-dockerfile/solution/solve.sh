#!/bin/bash
printf "%s\n" "$GREETING" > /app/greeting.txt
