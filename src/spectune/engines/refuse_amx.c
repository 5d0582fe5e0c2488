/* Preloaded into a llama.cpp tool run at its defaults on a CPU with AMX: refuses the kernel permission AMX tiles
 * need (arch_prctl ARCH_REQ_XCOMP_PERM), so ggml does not offer its AMX buffer type, whose kernels crash the
 * pinned llama.cpp on every model tried here (upstream issue ggml-org/llama.cpp#20824). Every other default,
 * the repacked weights included, stays as llama.cpp has it. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <sys/syscall.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define SYSCALL_ARGS 6

long syscall(long number, ...) {
    static long (*next_syscall)(long, ...);
    long args[SYSCALL_ARGS];
    va_list list;
    va_start(list, number);
    for (int i = 0; i < SYSCALL_ARGS; i++) {
        args[i] = va_arg(list, long);
    }
    va_end(list);
    if (number == SYS_arch_prctl && args[0] == ARCH_REQ_XCOMP_PERM) {
        errno = EPERM;
        return -1;
    }
    if (next_syscall == NULL) {
        next_syscall = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
    }
    return next_syscall(number, args[0], args[1], args[2], args[3], args[4], args[5]);
}
