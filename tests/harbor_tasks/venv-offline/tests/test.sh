#!/bin/bash
reward() {
  mkdir -p /logs/verifier
  if [ "$1" = 0 ]; then echo 1 > /logs/verifier/reward.txt; echo PASS; else echo 0 > /logs/verifier/reward.txt; echo FAIL; fi
}
[ "$(command -v python)" = /opt/venv/bin/python ] && python -c 'import sys; assert sys.prefix == "/opt/venv"'
reward $?
