#!/bin/bash
ls -1 /opt/names | sort > /app/names.txt
