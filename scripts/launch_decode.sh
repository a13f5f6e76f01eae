#!/usr/bin/env bash
# Start a zpd decode worker on this node; options and environment: launch_decode.sh --help.
exec bash "$(dirname "$0")/launch_worker.sh" decode "$@"
