#!/bin/bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPECDEC_HOME=/tmp/home
timeout 60 python3 -m pytest -q -p no:cacheprovider -rs tests/test_device.py -k "graphs or every_method" 2>&1 | tail -15 | tee $OUT/test_device.txt
