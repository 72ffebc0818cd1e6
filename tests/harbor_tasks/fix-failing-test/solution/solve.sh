#!/bin/bash
cd /app && sed -i 's|return sum(values) / (len(values) - 1)|return sum(values) / len(values)|' stats.py
python3 -m unittest test_stats
