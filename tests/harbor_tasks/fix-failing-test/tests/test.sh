#!/bin/bash
reward() {
  mkdir -p /logs/verifier
  if [ "$1" = 0 ]; then echo 1 > /logs/verifier/reward.txt; echo PASS; else echo 0 > /logs/verifier/reward.txt; echo FAIL; fi
}
mkdir -p /tmp/verify && cp /tests/test_stats.py /tmp/verify/ && cd /tmp/verify && PYTHONPATH=/app python3 -m unittest test_stats
reward $?
