#!/bin/bash
reward() {
  mkdir -p /logs/verifier
  if [ "$1" = 0 ]; then echo 1 > /logs/verifier/reward.txt; echo PASS; else echo 0 > /logs/verifier/reward.txt; echo FAIL; fi
}
printf 'east 17\nnorth 12\nwest 30\n' > /tmp/expected
cmp -s /tmp/expected /app/report.txt
reward $?
