#!/bin/bash
awk -F'\t' '{ s += $3 } END { print s }' /data/table.tsv > /app/total.txt
