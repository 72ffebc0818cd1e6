#!/bin/bash
python3 -c "import sqlite3; print(sqlite3.connect('/data/app.db').execute('select count(*) from items').fetchone()[0])" > /app/count.txt
