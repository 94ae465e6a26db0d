# call 3: the harness's GPU tests, then the rest of the GPU suite as time allows
source .devcarry/setup.sh
timeout 240 python3 -m pytest -q -rs -m gpu tests/test_harness_gpu.py tests/test_build_speed.py 2>&1 | tee $OUT/pytest_gpu_harness_$COMMIT.txt | tail -15
timeout $(( $(left) - 5 )) python3 -m pytest -q -rs -m gpu tests/ --deselect tests/test_harness_gpu.py --deselect tests/test_build_speed.py 2>&1 | tee $OUT/pytest_gpu_rest_$COMMIT.txt | tail -15
