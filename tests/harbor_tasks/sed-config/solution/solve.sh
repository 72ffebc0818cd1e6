#!/bin/bash
sed -i 's/^port = .*/port = 9090/' /etc/app/app.conf
