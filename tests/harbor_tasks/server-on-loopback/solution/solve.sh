#!/bin/bash
nohup python3 /app/server.py > /tmp/server.log 2>&1 &
for i in $(seq 50); do python3 -c 'import urllib.request as u; u.urlopen("http://127.0.0.1:8080/", timeout=1)' 2>/dev/null && exit 0; sleep 0.1; done
exit 1
