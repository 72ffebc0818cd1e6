#!/bin/bash
reward() {
  mkdir -p /logs/verifier
  if [ "$1" = 0 ]; then echo 1 > /logs/verifier/reward.txt; echo PASS; else echo 0 > /logs/verifier/reward.txt; echo FAIL; fi
}
[ "$(cat /opt/bundle/data/deep/three.txt)" = 3 ] && [ "$(find /opt/bundle -name '*.txt' | wc -l)" = 3 ]
reward $?
