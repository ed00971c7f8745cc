"""The offline data stage: prompt datasets -> chat-rendered, target-regenerated training rows -> Parquet shards
(launch/prepare_data.py), and the embedded default corpus. Modules: chat (the chat template and its loss mask),
corpus (the standard-library default corpus, JSONL corpora), rows (records -> rows -> shards, and reading shards
back), regenerate (the contract with whatever runs the target), prepare (the resumable stage over shards)."""
