/* st_reshard: one safetensors checkpoint rewritten in the other layout, streaming.
 *
 * The daemon keeps the global as one file whatever its size; what it publishes above --shard-size
 * is the Hugging Face index + shards layout (st_index.h), and what it adopts may be either.  This
 * copies every tensor of a source (one file, or an index and its shards) into st_set_writer, which
 * writes a single file when one shard is enough and the sharded layout otherwise.  Tensors go in the
 * source's data order (file by file, by offset), so each output shard's data is one contiguous range
 * of a single-file source.  Memory: one fixed buffer.  Blocking: run it on a pool thread. */
#ifndef ST_RESHARD_H
#define ST_RESHARD_H

#include <stdint.h>

#include "dl_error.h"
#include "safetensors.h"

/* Writes src (a .safetensors file or a .safetensors.index.json) to dst, named <dir>/<base>.safetensors,
 * sharded above max_shard_size bytes (0: one file).  src is opened with st_set_open_capped(src,
 * src_max_header): another writer's checkpoint (an adopted global) has its headers capped before they
 * are read; 0 keeps only the format's caps (the daemon's own global, the operator's --init-model).
 * The output's metadata is meta (a sharded output puts it in the index next to total_size; each shard
 * carries {"format": "pt"}); meta NULL carries the source's over (its "format" is the files' own: "pt"
 * on a single output, on shards only when sharded, as huggingface_hub writes them).  Every file is made
 * durable and renamed into place, the index last (st_set_writer_commit).  *nshards (when non-NULL)
 * receives 1 for a single file, else the shard count. */
int st_reshard(const char *src, uint64_t src_max_header, const char *dst, uint64_t max_shard_size, const st_kv *meta,
               size_t nmeta, uint32_t *nshards, dl_error *err);

#endif
