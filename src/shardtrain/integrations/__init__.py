"""Adapters that run shardtrain inside other trainers: Lightning Fabric (`integrations.fabric`), the
Lightning Trainer (`integrations.lightning`) and the Hugging Face Trainer (`integrations.transformers`).

Each is a thin layer over shardtrain's public calls (`st.shard`, `st.clip_grad_norm_`, `st.no_sync`,
`st.save_checkpoint` / `st.load_checkpoint`, `st.save_pretrained`); the engine knows nothing of
them. The host frameworks are optional extras (`pip install 'shardtrain[lightning]'`,
`'shardtrain[hf]'`, `'shardtrain[trl]'`): import a module only where its framework is installed.
Importing this package alone imports none of them.
"""
