#!/bin/bash
reward() {
  mkdir -p /logs/verifier
  if [ "$1" = 0 ]; then echo 1 > /logs/verifier/reward.txt; echo PASS; else echo 0 > /logs/verifier/reward.txt; echo FAIL; fi
}
[ "$(python3 -c "import sqlite3; print(sqlite3.connect('/data/app.db').execute('select sum(n) from items').fetchone()[0])")" = 21 ]
reward $?
