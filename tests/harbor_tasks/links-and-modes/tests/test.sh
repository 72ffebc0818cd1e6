#!/bin/bash
reward() {
  mkdir -p /logs/verifier
  if [ "$1" = 0 ]; then echo 1 > /logs/verifier/reward.txt; echo PASS; else echo 0 > /logs/verifier/reward.txt; echo FAIL; fi
}
[ "$(stat -c %a /opt/secret)" = 600 ] && [ "$(readlink /opt/current)" = /opt/releases/v2 ] && [ -d /opt/current ] \
  && [ "$(stat -c %a /opt/releases/v2)" = 4755 ]
reward $?
