#!/bin/bash
reward() {
  mkdir -p /logs/verifier
  if [ "$1" = 0 ]; then echo 1 > /logs/verifier/reward.txt; echo PASS; else echo 0 > /logs/verifier/reward.txt; echo FAIL; fi
}
[ "$(cat /etc/app-version)" = 1.2.3 ] && [ "$(cat /app/version.txt)" = 1.2.3 ]
reward $?
