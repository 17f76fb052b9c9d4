"""The weight wire format: what a push carries, shared by the trainer's side (`sync/`) and the engines' (`engine/`).

Both ends read the same modules, so neither imports the other's package for it:
  buckets.py         how a push is cut into buckets, and the dtypes a weight may travel in
  handover.py        the same-host JSON handover (one flat buffer, shared memory or CUDA IPC, never a pickle)
  sglang_payload.py  stock SGLang's flattened-bucket payload for `/update_weights_from_tensor`
  group.py           the torch.distributed weight group, formed as SGLang forms it
  finite.py          the finite check every push passes, and the error of weights that fail it
  delta.py           disk-delta versions: per-tensor XOR or index+value payloads, snapshots, manifests, checksums
Nothing here imports from hpcrl: only torch and the standard library.
"""
