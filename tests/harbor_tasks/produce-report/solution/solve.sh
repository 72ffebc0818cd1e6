#!/bin/bash
awk -F, 'NR > 1 { t[$1] += $2 } END { for (r in t) print r, t[r] }' /data/sales.csv | sort > /app/report.txt
