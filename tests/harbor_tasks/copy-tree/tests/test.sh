#!/bin/bash
reward() {
  mkdir -p /logs/verifier
  if [ "$1" = 0 ]; then echo 1 > /logs/verifier/reward.txt; echo PASS; else echo 0 > /logs/verifier/reward.txt; echo FAIL; fi
}
[ "$(cat /app/out.txt)" = "hello, greeter" ] && [ -f /opt/src/greeter/__init__.py ] && [ "$(stat -c %u:%g /opt/owned.txt)" = 1000:1000 ]
reward $?
