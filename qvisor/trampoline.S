# quark's exec trampoline: execve(argv[1], &argv[2], envp) if argv[0] is "quark-exec", else exit 126.
    .globl _start
    .text
_start:
    mov     (%rsp), %rax            # argc
    cmp     $3, %rax
    jl      refuse
    mov     8(%rsp), %rbx           # argv[0]
    movabs  $0x78652d6b72617571, %rcx   # "quark-ex"
    cmp     (%rbx), %rcx
    jne     refuse
    mov     8(%rbx), %ecx
    and     $0x00ffffff, %ecx
    cmp     $0x00006365, %ecx       # "ec\0"
    jne     refuse
    mov     16(%rsp), %rdi          # argv[1]: the program
    lea     24(%rsp), %rsi          # &argv[2]: its argv
    lea     16(%rsp,%rax,8), %rdx   # envp = &argv[argc + 1]
    mov     $59, %eax               # execve
    syscall
    mov     $127, %edi              # execve failed
    jmp     out
refuse:
    mov     $126, %edi
out:
    mov     $231, %eax              # exit_group
    syscall
