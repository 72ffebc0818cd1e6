#!/bin/bash
echo "$TASK_MODE" > /app/mode.txt
