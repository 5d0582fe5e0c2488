/* llama.cpp's abort callback for spectune's contexts: ggml asks it between the nodes of every graph it computes, on
   a compute thread. It reads a flag Python sets (LlamaModel.abort), so a stopping server cuts a long prefill batch
   within a node instead of waiting seconds for it; a Python callback would take the GIL hundreds of times a token. */
#include <stdbool.h>

bool spectune_abort_requested(void *flag) { return *(volatile bool *)flag; }
