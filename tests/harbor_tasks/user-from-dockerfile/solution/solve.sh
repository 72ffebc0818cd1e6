#!/bin/bash
whoami > ~/notes.txt
