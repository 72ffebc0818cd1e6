#!/bin/bash
[ -x /opt/venv/bin/python ] || python3 -m venv --without-pip /opt/venv
