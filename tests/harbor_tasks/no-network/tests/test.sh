#!/bin/bash
reward() {
  mkdir -p /logs/verifier
  if [ "$1" = 0 ]; then echo 1 > /logs/verifier/reward.txt; echo PASS; else echo 0 > /logs/verifier/reward.txt; echo FAIL; fi
}
# Only lo, and no route anywhere: read from /proc, no packet sent.
ifaces=$(awk -F: 'NR > 2 { gsub(/ /, "", $1); print $1 }' /proc/net/dev | sort | tr '\n' ' ')
routes=$(awk 'NR > 1' /proc/net/route | wc -l)
echo "interfaces: $ifaces routes: $routes"
[ "$ifaces" = "lo " ] && [ "$routes" = 0 ]
reward $?
