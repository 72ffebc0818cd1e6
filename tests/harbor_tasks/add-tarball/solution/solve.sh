#!/bin/bash
cat $(find /opt/bundle -name '*.txt') | awk '{ s += $1 } END { print s }' > /app/sum.txt
