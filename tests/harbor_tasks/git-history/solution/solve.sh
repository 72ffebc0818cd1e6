#!/bin/bash
[ "$(git -C /repo rev-list --count HEAD)" -ge 2 ] || { echo more >> /repo/f; git -C /repo commit -qam more; }
