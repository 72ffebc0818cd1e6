#!/bin/bash
head -c 20971520 /dev/zero > /app/blob.bin
