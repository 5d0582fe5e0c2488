// C names for the libllama functions a head needs beside its target: an EAGLE-3 head (runtime/eagle3_head.py) and
// Gemma 4's MTP assistant (runtime/mtp_assistant.py).
//
// The pinned llama.cpp exports them (LLAMA_API) but declares them in src/llama-ext.h without extern "C", so their
// symbols are C++-mangled. These declarations copy llama-ext.h's; the compiler derives the mangled names from them,
// and the link (-Wl,--no-undefined against the very libllama the binding loads) fails if the library lacks any
// function of that signature: a mismatch stops the build instead of corrupting a call.
#include <cstdint>

struct llama_context;
struct llama_model;

void          llama_set_embeddings_layer_inp(llama_context * ctx, uint32_t lid, bool value);
float *       llama_get_embeddings_layer_inp(llama_context * ctx, uint32_t lid);
void          llama_set_embeddings_nextn(llama_context * ctx, bool value, bool masked);
float *       llama_get_embeddings_nextn(llama_context * ctx);
float *       llama_get_embeddings_nextn_ith(llama_context * ctx, int32_t i);
const int32_t * llama_model_target_layer_ids(const llama_model * model);
uint32_t      llama_model_target_layer_ids_n(const llama_model * model);

extern "C" {

// The target: keep the input of layer `lid` of every token a decode computes.
void spectune_keep_layer_input(llama_context * ctx, uint32_t lid) {
    llama_set_embeddings_layer_inp(ctx, lid, true);
}

// Rows [n_tokens of the last decode, n_embd]: valid until the next decode.
float * spectune_layer_input(llama_context * ctx, uint32_t lid) {
    return llama_get_embeddings_layer_inp(ctx, lid);
}

// The head: keep its pre-norm hidden state (the encoder's output g, the decoder's state for the next step) for the
// rows a batch marks as outputs.
void spectune_keep_hidden_state(llama_context * ctx) {
    llama_set_embeddings_nextn(ctx, true, true);
}

// The target of an MTP assistant: keep the post-norm hidden state of every token a decode computes, outputs or not.
void spectune_keep_all_hidden_states(llama_context * ctx) {
    llama_set_embeddings_nextn(ctx, true, false);
}

// Every output row's hidden state of the last batch, in batch order (the encoder's g, row by row).
float * spectune_hidden_states(llama_context * ctx) {
    return llama_get_embeddings_nextn(ctx);
}

// The hidden state of the batch's entry `i` (an output).
float * spectune_hidden_state(llama_context * ctx, int32_t i) {
    return llama_get_embeddings_nextn_ith(ctx, i);
}

// The target layers whose inputs the head reads, as its GGUF names them; their count.
const int32_t * spectune_head_layers(const llama_model * model) {
    return llama_model_target_layer_ids(model);
}

uint32_t spectune_head_layer_count(const llama_model * model) {
    return llama_model_target_layer_ids_n(model);
}

}
