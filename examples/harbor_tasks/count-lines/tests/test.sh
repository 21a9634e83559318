#!/bin/bash
# Named rewards: reward.json, a flat object of numbers (Harbor reads it before reward.txt).
mkdir -p /logs/verifier
expected=$(wc -l < /app/data.txt)
got=$(tr -d '[:space:]' < /app/count.txt 2>/dev/null)
exists=0; [ -f /app/count.txt ] && exists=1
if [ "$got" = "$expected" ]; then r=1; else r=0; fi
echo "{\"reward\": $r, \"file_written\": $exists}" > /logs/verifier/reward.json
