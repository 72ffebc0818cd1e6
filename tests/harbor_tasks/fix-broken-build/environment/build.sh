#!/bin/bash
set -euo pipefail
mkdir -p dist
cat srcs/a.py srcs/b.py srcs/main.py > dist/app.py
python3 dist/app.py
