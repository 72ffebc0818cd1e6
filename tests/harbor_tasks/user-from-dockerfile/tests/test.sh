#!/bin/bash
reward() {
  mkdir -p /logs/verifier
  if [ "$1" = 0 ]; then echo 1 > /logs/verifier/reward.txt; echo PASS; else echo 0 > /logs/verifier/reward.txt; echo FAIL; fi
}
[ "$(id -un)" = grader ] && [ "$(cat /home/grader/notes.txt)" = grader ] && [ "$(stat -c %U /home/grader/notes.txt)" = grader ]
reward $?
