#!/usr/bin/env bash
# Stand-in for `ssh HOST COMMAND` in tests: runs COMMAND on this machine (stdin passed through).
shift
exec sh -c "$*"
