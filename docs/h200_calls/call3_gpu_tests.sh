# call 3: the whole GPU suite, the harness's tests first
source .devcarry/setup.sh
timeout 240 python3 -m pytest -q -rs -m gpu tests/test_harness_gpu.py tests/test_build_speed.py 2>&1 | tee $OUT/pytest_gpu_harness_$COMMIT.txt | tail -15
timeout $(( $(left) - 5 )) python3 -m pytest -q -rs -m gpu tests/ --deselect tests/test_harness_gpu.py --deselect tests/test_build_speed.py 2>&1 | tee $OUT/pytest_gpu_rest_$COMMIT.txt | tail -15
