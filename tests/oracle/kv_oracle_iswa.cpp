// Oracle shim over llama.cpp's own llama_kv_cache_iswa (llama-cpp-python 0.3.17's llama.cpp): a C API that the
// iSWA trace tests drive with ctypes. Test tool only; built by build_iswa.sh next to this file, the same way the
// shared oracle's build.sh builds kv_oracle.cpp (which stays as it is).
#define private public
#define protected public
#include "llama-kv-cache-iswa.h"
#include "llama-kv-cache.h"
#include "llama-model.h"
#include "llama-batch.h"
#include "llama-io.h"
#undef private
#undef protected
#include "llama.h"
#include <chrono>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

struct kvi {
    llama_model * model;
    std::unique_ptr<llama_kv_cache_iswa> kv;
    uint32_t n_seq_max;
};

static llama_kv_cache * cache_of(kvi * h, int which) { return which == 0 ? h->kv->get_base() : h->kv->get_swa(); }

struct kvi_writer : llama_io_write_i {
    std::vector<uint8_t> v;
    void write(const void * src, size_t n) override { auto * s = (const uint8_t *) src; v.insert(v.end(), s, s + n); }
    void write_tensor(const ggml_tensor * t, size_t off, size_t n) override {
        std::vector<uint8_t> tmp(n); ggml_backend_tensor_get(t, tmp.data(), off, n); write(tmp.data(), n);
    }
    size_t n_bytes() override { return v.size(); }
};

struct kvi_reader : llama_io_read_i {
    const uint8_t * p; size_t n, at = 0;
    kvi_reader(const uint8_t * p, size_t n) : p(p), n(n) {}
    const uint8_t * read(size_t size) override {
        if (at + size > n) throw std::runtime_error("unexpectedly reached end of buffer");
        const uint8_t * r = p + at; at += size; return r;
    }
    void read_to(void * dst, size_t size) override { memcpy(dst, read(size), size); }
    size_t n_bytes() override { return at; }
};

extern "C" {

void * kvi_create(const char * path, int type_k, int type_v, int v_trans, int swa_full, int unified, uint32_t kv_size,
                  uint32_t n_seq_max, uint32_t n_ubatch, uint32_t n_pad) {
    static bool init = false;
    if (!init) { llama_backend_init(); llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr); init = true; }
    auto mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * m = llama_model_load_from_file(path, mp);
    if (!m) return nullptr;
    auto * h = new kvi();
    h->model = m;
    h->n_seq_max = n_seq_max;
    h->kv.reset(new llama_kv_cache_iswa(*m, (ggml_type) type_k, (ggml_type) type_v, v_trans, false, swa_full, unified,
                                        kv_size, n_seq_max, n_ubatch, n_pad, nullptr, nullptr));
    return h;
}

void kvi_free(void * p) { auto * h = (kvi *) p; llama_model_free(h->model); delete h; }

// balloc.init + init_batch + apply of every ubatch (bookkeeping only). seq_ids: n*8, -1 padded.
// out_base[i] / out_swa[i] = strm*size + cell of token i (ubatch order) in each cache; returns the number of
// ubatches, -1 when balloc.init refuses the batch, -2 when init_batch fails
int kvi_decode(void * p, int n, const int32_t * pos, const int32_t * seq_ids, uint32_t n_ubatch, int use_pos,
               int32_t * out_base, int32_t * out_swa, int32_t * out_sizes) {
    auto * h = (kvi *) p;
    llama_batch b = llama_batch_init(n, 0, 8);
    b.n_tokens = n;
    for (int i = 0; i < n; ++i) {
        b.token[i] = 3;
        b.pos[i] = pos[i];
        int k = 0;
        for (; k < 8 && seq_ids[i*8 + k] >= 0; ++k) b.seq_id[i][k] = seq_ids[i*8 + k];
        b.n_seq_id[i] = k;
        b.logits[i] = i == n - 1;
    }
    llama_batch bb = b;
    if (!use_pos) bb.pos = nullptr;
    llama_batch_allocr balloc(h->model->hparams.n_pos_per_embd());
    if (!balloc.init(bb, h->model->vocab, h->kv.get(), h->model->hparams.n_embd, h->n_seq_max, false)) {
        llama_batch_free(b);
        return -1;
    }
    auto ctx = h->kv->init_batch(balloc, n_ubatch, false);
    if (ctx->get_status() != LLAMA_MEMORY_STATUS_SUCCESS) { llama_batch_free(b); return -2; }
    auto * ictx = (llama_kv_cache_iswa_context *) ctx.get();
    int nu = 0, o = 0;
    do {
        ctx->apply();
        int ob = o;
        for (int which = 0; which < 2; ++which) {
            const auto * kc = which == 0 ? ictx->get_base() : ictx->get_swa();
            const auto & sinfo = kc->sinfos[kc->i_cur];
            const uint32_t size = cache_of(h, which)->get_size();
            int32_t * out = which == 0 ? out_base : out_swa;
            int k = ob;
            for (size_t s = 0; s < sinfo.n_stream(); ++s)
                for (size_t i = 0; i < sinfo.size(); ++i)
                    out[k++] = sinfo.strm[s] * size + sinfo.idxs[s][i];
            o = k;
        }
        out_sizes[nu++] = ictx->get_ubatch().n_tokens;
    } while (ctx->next());
    llama_batch_free(b);
    return nu;
}

int  kvi_seq_rm  (void * p, int s, int p0, int p1) { return ((kvi *) p)->kv->seq_rm(s, p0, p1); }
void kvi_seq_cp  (void * p, int a, int b, int p0, int p1) { ((kvi *) p)->kv->seq_cp(a, b, p0, p1); }
void kvi_seq_keep(void * p, int s) { ((kvi *) p)->kv->seq_keep(s); }
void kvi_seq_add (void * p, int s, int p0, int p1, int d) { ((kvi *) p)->kv->seq_add(s, p0, p1, d); }
void kvi_seq_div (void * p, int s, int p0, int p1, int d) { ((kvi *) p)->kv->seq_div(s, p0, p1, d); }
int  kvi_seq_pos_min(void * p, int s) { return ((kvi *) p)->kv->seq_pos_min(s); }
int  kvi_seq_pos_max(void * p, int s) { return ((kvi *) p)->kv->seq_pos_max(s); }
void kvi_clear(void * p) { ((kvi *) p)->kv->clear(true); }
int  kvi_can_shift(void * p) { return ((kvi *) p)->kv->get_can_shift(); }
uint32_t kvi_n_stream(void * p) { return ((kvi *) p)->kv->get_base()->get_n_stream(); }
uint32_t kvi_size(void * p, int which) { return cache_of((kvi *) p, which)->get_size(); }

// cache `which` (0 base, 1 SWA): every cell's position, shift and 4x64-bit sequence mask; the heads
void kvi_dump(void * p, int which, int32_t * pos, int32_t * shift, uint64_t * seq, uint32_t * heads) {
    auto * kv = cache_of((kvi *) p, which);
    const uint32_t n = kv->get_size();
    for (uint32_t s = 0; s < kv->get_n_stream(); ++s) {
        const auto & c = kv->v_cells[s];
        heads[s] = kv->v_heads[s];
        for (uint32_t i = 0; i < n; ++i) {
            pos[s*n + i] = c.is_empty(i) ? -1 : c.pos_get(i);
            shift[s*n + i] = c.is_empty(i) ? 0 : c.get_shift(i);
            for (int w = 0; w < 4; ++w) {
                uint64_t m = 0;
                for (int bit = 0; bit < 64; ++bit) if (c.seq_has(i, w*64 + bit)) m |= 1ull << bit;
                seq[(size_t)(s*n + i)*4 + w] = m;
            }
        }
    }
}

// state_write of the iSWA cache (seq -1: all) with flags; returns the size, copies it to out when cap allows
size_t kvi_state(void * p, int seq, int flags, uint8_t * out, size_t cap) {
    kvi_writer w;
    ((kvi *) p)->kv->state_write(w, seq, flags);
    if (out && cap >= w.v.size()) memcpy(out, w.v.data(), w.v.size());
    return w.v.size();
}

// state_read; returns the bytes read, or 0 when llama.cpp throws
size_t kvi_state_read(void * p, int seq, int flags, const uint8_t * data, size_t n) {
    kvi_reader r(data, n);
    try {
        ((kvi *) p)->kv->state_read(r, seq, flags);
    } catch (const std::exception &) {
        return 0;
    }
    return r.n_bytes();
}

// timing: n one-token decodes of seq at positions pos0, pos0+1, ... (balloc.init + init_batch + apply, kept);
// returns ns per step, or -1 when a step fails
double kvi_time_steps(void * p, int seq, int pos0, int n) {
    auto * h = (kvi *) p;
    llama_batch b = llama_batch_init(1, 0, 1);
    b.n_tokens = 1; b.token[0] = 3; b.n_seq_id[0] = 1; b.seq_id[0][0] = seq; b.logits[0] = 1;
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) {
        b.pos[0] = pos0 + i;
        llama_batch_allocr balloc(1);
        balloc.init(b, h->model->vocab, h->kv.get(), h->model->hparams.n_embd, h->n_seq_max, false);
        auto ctx = h->kv->init_batch(balloc, 512, false);
        if (ctx->get_status() != LLAMA_MEMORY_STATUS_SUCCESS) { llama_batch_free(b); return -1; }
        ctx->apply();
    }
    auto t1 = std::chrono::steady_clock::now();
    llama_batch_free(b);
    return std::chrono::duration<double, std::nano>(t1 - t0).count() / n;
}

}
