#!/bin/bash
perl -pi -e 's/(\w+)/\U$1/g' /app/words.txt
