#!/bin/bash
reward() {
  mkdir -p /logs/verifier
  if [ "$1" = 0 ]; then echo 1 > /logs/verifier/reward.txt; echo PASS; else echo 0 > /logs/verifier/reward.txt; echo FAIL; fi
}
[ "$(cat /app/total.txt)" = 60 ] && [ "$(awk -F'\t' 'END { print NR }' /data/table.tsv)" = 3 ]
reward $?
