#!/bin/bash
sed -i 's#srcs/#src/#g' /app/build.sh
/app/build.sh
