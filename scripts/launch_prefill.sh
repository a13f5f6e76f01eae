#!/usr/bin/env bash
# Start a zpd prefill worker on this node; options and environment: launch_prefill.sh --help.
exec bash "$(dirname "$0")/launch_worker.sh" prefill "$@"
