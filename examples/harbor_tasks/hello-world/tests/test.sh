#!/bin/bash
# Harbor copies tests/ to /tests and runs this from the workdir (/app); the reward goes to /logs/verifier.
mkdir -p /logs/verifier
if [ "$(cat /app/out.txt 2>/dev/null | tr -d '[:space:]')" = "hello" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
