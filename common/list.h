/*
 * Intrusive doubly linked lists, the shape the daemon uses for holds, pool
 * instances, slabs, leases and waiters: each node carries its own prev/next pointers (named by
 * the caller, so one node can sit on two lists), the list is a head pointer. As BSD
 * <sys/queue.h>'s LIST_REMOVE, without its structs.
 */
#ifndef GPUPOOL_COMMON_LIST_H
#define GPUPOOL_COMMON_LIST_H

/* Take node n off the list whose first node is head (an lvalue), through its fields prev and
 * next. n's own pointers are left as they were. */
#define GPUPOOL__LIST_UNLINK(head, n, prev, next) \
  do {                                           \
    if ((n)->prev)                               \
      (n)->prev->next = (n)->next;               \
    else                                         \
      (head) = (n)->next;                        \
    if ((n)->next)                               \
      (n)->next->prev = (n)->prev;               \
  } while (0)

#endif
