#!/bin/bash
python3 -m unittest discover -s tests 2>&1 | tail -1 > /app/summary.txt
