#!/bin/bash
reward() {
  mkdir -p /logs/verifier
  if [ "$1" = 0 ]; then echo 1 > /logs/verifier/reward.txt; echo PASS; else echo 0 > /logs/verifier/reward.txt; echo FAIL; fi
}
ask() { python3 -c 'import urllib.request as u; print(u.urlopen("http://127.0.0.1:8080/health", timeout=2).read().decode())'; }
if ! ask > /tmp/answer 2>/dev/null; then
  echo "no server running: starting /app/server.py"
  nohup python3 /app/server.py > /tmp/server.log 2>&1 &
  for i in $(seq 50); do ask > /tmp/answer 2>/dev/null && break; sleep 0.1; done
fi
grep -qx 'ok /health' /tmp/answer
reward $?
