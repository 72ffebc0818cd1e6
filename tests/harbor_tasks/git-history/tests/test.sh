#!/bin/bash
reward() {
  mkdir -p /logs/verifier
  if [ "$1" = 0 ]; then echo 1 > /logs/verifier/reward.txt; echo PASS; else echo 0 > /logs/verifier/reward.txt; echo FAIL; fi
}
[ "$(git -C /repo rev-list --count HEAD)" -ge 2 ] && [ "$(git -C /repo show HEAD:f | head -1)" = one ]
reward $?
