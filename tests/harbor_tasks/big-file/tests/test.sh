#!/bin/bash
reward() {
  mkdir -p /logs/verifier
  if [ "$1" = 0 ]; then echo 1 > /logs/verifier/reward.txt; echo PASS; else echo 0 > /logs/verifier/reward.txt; echo FAIL; fi
}
[ "$(stat -c %s /app/blob.bin)" = 20971520 ] && [ "$(tr -d '\0' < /app/blob.bin | wc -c)" = 0 ]
reward $?
