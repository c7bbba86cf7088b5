#!/usr/bin/env bash
# DeepSpeed ZeRO-Inference as a peer for the GPU campaign (issue 72), made ahead on a machine
# with a package index, for a lent card that has none: DeepSpeed from PyPI (its ops built by the
# card's nvcc when first used), the transformers fork its KV offload needs (tjruwase/transformers,
# branch kvcache-offload-cpu, 4.33.0.dev0) as a wheel, and DeepSpeedExamples' zero_inference driver.
#
#   bash bench/build_deepspeed_kit.sh TRANSFORMERS_FORK_GIT DEEPSPEED_EXAMPLES_GIT [OUT]
#
# The two git directories are the public repositories' clones (a session's `fetch` brings them);
# OUT defaults to .device-kit/deepspeed (ignored by git, carried with the kit). Two deviations,
# both forced by Python 3.12 on the card: the fork's upper pins on tokenizers (<0.14, which has
# no cp312 wheel) and huggingface-hub (<1.0) are dropped; nothing else of either source changes.
# The driver at DeepSpeedExamples' HEAD imports transformers.integrations.deepspeed, which the fork
# keeps at transformers.deepspeed: a step that runs it must alias that module (none is written yet).
set -euo pipefail
FORK="$1"; EXAMPLES="$2"; OUT="${3:-.device-kit/deepspeed}"
VER=0.19.8
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT/wheels" "$OUT/zero_inference"
python3 -m pip download -q --no-deps --no-binary :all: "deepspeed==$VER" -d "$WORK"
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation "$WORK/deepspeed-$VER.tar.gz" -w "$OUT/wheels"
mkdir "$WORK/fork"
git -C "$FORK" archive kvcache-offload-cpu | tar -x -C "$WORK/fork"
sed -i 's/"tokenizers": "tokenizers>=0.11.1,!=0.11.3,<0.14"/"tokenizers": "tokenizers>=0.11.1,!=0.11.3"/;
        s/"huggingface-hub": "huggingface-hub>=0.15.1,<1.0"/"huggingface-hub": "huggingface-hub>=0.15.1"/' \
  "$WORK/fork/src/transformers/dependency_versions_table.py"
python3 -m pip wheel -q --no-deps --no-build-isolation "$WORK/fork" -w "$OUT/wheels"
# what DeepSpeed needs that the card's image lacks (the device README's package list), for Python 3.12
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  hjson einops -d "$OUT/wheels"
for f in run_model.py utils.py timer.py README.md; do
  git -C "$EXAMPLES" show "HEAD:inference/huggingface/zero_inference/$f" > "$OUT/zero_inference/$f"
done
echo "deepspeed $VER, transformers fork $(git -C "$FORK" rev-parse --short kvcache-offload-cpu), DeepSpeedExamples $(git -C "$EXAMPLES" rev-parse --short HEAD)" > "$OUT/VERSION"
cat "$OUT/VERSION"; du -sh "$OUT"
