#!/bin/bash
reward() {
  mkdir -p /logs/verifier
  if [ "$1" = 0 ]; then echo 1 > /logs/verifier/reward.txt; echo PASS; else echo 0 > /logs/verifier/reward.txt; echo FAIL; fi
}
grep -qx 'port = 9090' /etc/app/app.conf && grep -qx 'name = demo' /etc/app/app.conf && [ "$(wc -l < /etc/app/app.conf)" = 3 ]
reward $?
