#!/bin/bash
python3 -m greeter > /app/out.txt
