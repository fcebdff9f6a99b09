// A timing anchor the oracle shim lacks: one decode step of n sequences at once (one token each, sequences
// 0..n-1), on llama.cpp's own llama_kv_cache, undone with one seq_rm per sequence.  Built by benchmarks/_oracle.py
// against the oracle's llama.cpp build; it includes the oracle's shim (KV_ORACLE_CPP) for its handle layout.
// Measurement tool only.
#include KV_ORACLE_CPP

extern "C" {

// fill: n tokens of sequence seq at positions pos0.. (ubatches of n_ubatch), bookkeeping only (no mask copies:
// kvo_decode keeps every ubatch's mask, far too slow for a cache of 131072 cells); returns 0, or <0 on failure
int kvo_fill(void * p, int seq, int pos0, int n, int n_ubatch) {
    auto * h = (kvo *) p;
    llama_batch b = llama_batch_init(n, 0, 1);
    b.n_tokens = n;
    for (int i = 0; i < n; ++i) {
        b.token[i] = 3; b.pos[i] = pos0 + i; b.n_seq_id[i] = 1; b.seq_id[i][0] = seq; b.logits[i] = i == n - 1;
    }
    llama_batch_allocr balloc(1);
    int rc = 0;
    if (!balloc.init(b, h->model->vocab, h->kv.get(), h->model->hparams.n_embd, h->n_seq_max, false)) {
        rc = -1;
    } else {
        auto ctx = h->kv->init_batch(balloc, n_ubatch, false);
        if (ctx->get_status() != LLAMA_MEMORY_STATUS_SUCCESS) {
            rc = -2;
        } else {
            do { ctx->apply(); } while (ctx->next());
        }
    }
    llama_batch_free(b);
    return rc;
}

// iters x (balloc.init + init_batch + apply; level >= 1: + set_input_k_idxs/v_idxs; level >= 2: + kq mask),
// each undone with seq_rm(s, pos[s], -1) for every sequence; returns ns per step.
double kvo_time_step_multi(void * p, int n_seq, const int32_t * pos, int iters, int level) {
    auto * h = (kvo *) p;
    llama_batch b = llama_batch_init(n_seq, 0, 1);
    b.n_tokens = n_seq;
    for (int s = 0; s < n_seq; ++s) {
        b.token[s] = 3; b.pos[s] = pos[s]; b.n_seq_id[s] = 1; b.seq_id[s][0] = s; b.logits[s] = 1;
    }
    ggml_init_params ip = { ggml_tensor_overhead()*8, nullptr, true };
    ggml_context * gctx = ggml_init(ip);
    const uint32_t kvs = h->kv->get_size();
    ggml_tensor * tm = ggml_new_tensor_4d(gctx, GGML_TYPE_F32, kvs, n_seq, 1, 1);
    ggml_tensor * tk = ggml_new_tensor_1d(gctx, GGML_TYPE_I64, n_seq);
    ggml_tensor * tv = ggml_new_tensor_1d(gctx, GGML_TYPE_I64, n_seq*h->model->hparams.n_embd_v_gqa_max());
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(gctx, ggml_backend_cpu_buffer_type());
    double ns = -1.0;
    auto t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < iters; ++it) {
        llama_batch_allocr balloc(1);
        if (!balloc.init(b, h->model->vocab, h->kv.get(), h->model->hparams.n_embd, h->n_seq_max, false)) goto done;
        {
            auto ctx = h->kv->init_batch(balloc, 512, false);
            if (ctx->get_status() != LLAMA_MEMORY_STATUS_SUCCESS) goto done;
            auto * kctx = (llama_kv_cache_context *) ctx.get();
            do {
                ctx->apply();
                const auto & ub = kctx->get_ubatch();
                if (level >= 1) {
                    tk->ne[0] = ub.n_tokens; tk->nb[1] = tk->nb[2] = tk->nb[3] = ub.n_tokens*8;
                    const int64_t nv = tv->ne[0] / n_seq * ub.n_tokens;
                    kctx->set_input_k_idxs(tk, &ub);
                    tv->ne[0] = nv; tv->nb[1] = tv->nb[2] = tv->nb[3] = nv*8;
                    kctx->set_input_v_idxs(tv, &ub);
                    tv->ne[0] = n_seq*h->model->hparams.n_embd_v_gqa_max();
                }
                if (level >= 2) {
                    const uint32_t n_stream = kctx->sinfos[kctx->i_cur].n_stream();
                    tm->ne[0] = kctx->get_n_kv(); tm->ne[1] = ub.n_tokens / n_stream; tm->ne[3] = n_stream;
                    tm->nb[1] = tm->ne[0]*4; tm->nb[2] = tm->nb[1]*tm->ne[1]; tm->nb[3] = tm->nb[2];
                    kctx->set_input_kq_mask(tm, &ub, true);
                }
            } while (ctx->next());
        }
        for (int s = 0; s < n_seq; ++s) h->kv->seq_rm(s, pos[s], -1);
    }
    ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / iters;
done:
    ggml_backend_buffer_free(buf); ggml_free(gctx); llama_batch_free(b);
    return ns;
}

}
