/* The parallel launcher of dsv41's CPU artifacts: TVM's `TVMBackendParallelLaunch` ABI over a
 * pool whose idle workers wait on a spin of `pause` instructions for a bounded time, then
 * sleep on a futex (see runtime/backends/launcher.py for why, and for how it is installed).
 *
 * A launch: the caller publishes the job (function, closure, number of tasks) under a new
 * generation, wakes sleeping workers only when there are any, and then claims tasks itself like
 * every worker does, one task id at a time from a single 64-bit word (generation | number of
 * tasks | next task), so a worker still looking at an older job can never claim one of a newer
 * job's tasks. The caller returns when all tasks are done. Task t computes what it computes
 * under TVM's own pool (the generated code partitions its loop by task id and number of tasks,
 * the same numbers here), so results are bit for bit the same whichever thread runs it.
 *
 * Serial (every task on the caller, in order): a launch from inside a task (nesting), a launch
 * while another thread's launch holds the pool, one task, or a pool of one thread. A failed task
 * (a non-zero return: the kernel raised) is run again on the caller after the others, so the
 * error it raises is the caller's thread's error, which TVM then reports.
 * After fork() the child starts its own workers at its first launch. */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct {
  void* sync_handle;
  int32_t num_task;
} TVMParallelGroupEnv;
typedef int (*FTVMParallelLambda)(int task_id, TVMParallelGroupEnv* penv, void* cdata);

#define DSV41_LAUNCHER_ABI 1
#define MAX_THREADS 256
#define MAX_TASKS 0xffff
#define CLOCK_EVERY 64 /* pauses between clock reads while spinning */

struct pool {
  pthread_mutex_t lock; /* held by a launch (trylock) and by configure */
  int threads;          /* the caller included */
  int running;          /* workers started (threads - 1 of them) */
  long spin_ns;         /* how long an idle worker (and a waiting caller) spins */
  pthread_t workers[MAX_THREADS];
  _Atomic uint32_t gen;       /* job generation: the workers' futex word */
  _Atomic uint32_t sleepers;  /* workers asleep on gen */
  _Atomic uint64_t claim;     /* gen << 32 | tasks << 16 | next task */
  _Atomic uint32_t done;      /* tasks finished: the caller's futex word */
  _Atomic uint32_t caller_sleeping;
  _Atomic int32_t failed_task;
  _Atomic int stop;
  FTVMParallelLambda fn; /* the job: written before gen is published */
  void* cdata;
  TVMParallelGroupEnv env;
  _Atomic uint64_t pooled;  /* launches the pool ran */
  _Atomic uint64_t serial;  /* launches run serially on their caller */
};

static struct pool P = {.lock = PTHREAD_MUTEX_INITIALIZER, .threads = 1};
static __thread int in_task;

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

static long now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void futex_wait(_Atomic uint32_t* word, uint32_t value) {
  syscall(SYS_futex, (uint32_t*)word, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t* word) {
  syscall(SYS_futex, (uint32_t*)word, FUTEX_WAKE_PRIVATE, MAX_THREADS, NULL, NULL, 0);
}

/* Claim and run tasks of generation g until none is left to claim. */
static void run_tasks(uint32_t g) {
  for (;;) {
    uint64_t c = atomic_load_explicit(&P.claim, memory_order_acquire);
    uint32_t tasks = (uint32_t)(c >> 16) & MAX_TASKS, t = (uint32_t)c & MAX_TASKS;
    if ((uint32_t)(c >> 32) != g || t >= tasks) return;
    if (!atomic_compare_exchange_weak_explicit(&P.claim, &c, c + 1, memory_order_acq_rel,
                                               memory_order_acquire))
      continue;
    /* task t of job g is ours and job g cannot end before it does: its fields stay */
    in_task = 1;
    int rc = P.fn((int)t, &P.env, P.cdata);
    in_task = 0;
    if (rc != 0) {
      int32_t none = -1;
      atomic_compare_exchange_strong(&P.failed_task, &none, (int32_t)t);
    }
    if (atomic_fetch_add(&P.done, 1) + 1 == tasks && atomic_load(&P.caller_sleeping))
      futex_wake_all(&P.done);
  }
}

static void* worker_main(void* arg) {
  (void)arg;
  uint32_t seen = atomic_load(&P.gen);
  for (;;) {
    uint32_t g = atomic_load_explicit(&P.gen, memory_order_acquire);
    if (g == seen) {
      long until = now_ns() + P.spin_ns;
      for (int i = 1; (g = atomic_load_explicit(&P.gen, memory_order_acquire)) == seen; ++i) {
        relax();
        if (i % CLOCK_EVERY == 0 && now_ns() > until) break;
      }
      if (g == seen) {
        atomic_fetch_add(&P.sleepers, 1);
        while ((g = atomic_load(&P.gen)) == seen) futex_wait(&P.gen, seen);
        atomic_fetch_sub(&P.sleepers, 1);
      }
    }
    if (atomic_load(&P.stop)) return NULL;
    seen = g;
    run_tasks(g);
  }
}

/* With the lock held: stop and join the workers. */
static void stop_workers(void) {
  if (P.running) {
    atomic_store(&P.stop, 1);
    atomic_fetch_add(&P.gen, 1);
    futex_wake_all(&P.gen);
    for (int i = 1; i < P.threads; ++i) pthread_join(P.workers[i], NULL);
    atomic_store(&P.stop, 0);
    P.running = 0;
  }
}

/* With the lock held: start threads - 1 workers (fewer if the system refuses threads). */
static void start_workers(void) {
  int started = 1;
  for (; started < P.threads; ++started)
    if (pthread_create(&P.workers[started], NULL, worker_main, NULL) != 0) break;
  P.threads = started;
  P.running = started > 1;
}

static void after_fork_in_child(void) {
  pthread_mutex_init(&P.lock, NULL); /* the parent's holder does not exist here */
  P.running = 0;                     /* nor do its workers: started again at the first launch */
  atomic_store(&P.sleepers, 0);
  atomic_store(&P.caller_sleeping, 0);
}

int dsv41_launcher_abi(void) { return DSV41_LAUNCHER_ABI; }

/* Size the pool (the caller included) and set the spin; returns the threads it runs. */
int dsv41_launcher_configure(int threads, long spin_ns) {
  pthread_mutex_lock(&P.lock);
  stop_workers();
  P.threads = threads < 1 ? 1 : (threads > MAX_THREADS ? MAX_THREADS : threads);
  P.spin_ns = spin_ns < 0 ? 0 : spin_ns;
  start_workers();
  int n = P.threads;
  pthread_mutex_unlock(&P.lock);
  return n;
}

/* launches run by the pool and serially since the library was loaded */
void dsv41_launcher_counts(uint64_t* pooled, uint64_t* serial) {
  *pooled = atomic_load(&P.pooled);
  *serial = atomic_load(&P.serial);
}

static int run_serially(FTVMParallelLambda fn, void* cdata, int tasks) {
  atomic_fetch_add(&P.serial, 1);
  TVMParallelGroupEnv env = {NULL, tasks};
  for (int t = 0; t < tasks; ++t) {
    int rc = fn(t, &env, cdata);
    if (rc != 0) return rc;
  }
  return 0;
}

int dsv41_parallel_launch(FTVMParallelLambda fn, void* cdata, int num_task) {
  int tasks = num_task > 0 ? num_task : P.threads;
  if (in_task || tasks == 1 || tasks > MAX_TASKS || P.threads <= 1 ||
      pthread_mutex_trylock(&P.lock) != 0)
    return run_serially(fn, cdata, tasks);
  if (!P.running) start_workers(); /* after fork */
  atomic_fetch_add(&P.pooled, 1);
  P.fn = fn;
  P.cdata = cdata;
  P.env.sync_handle = NULL;
  P.env.num_task = tasks;
  atomic_store(&P.done, 0);
  atomic_store(&P.failed_task, -1);
  uint32_t g = atomic_load(&P.gen) + 1;
  atomic_store(&P.claim, ((uint64_t)g << 32) | ((uint64_t)tasks << 16));
  atomic_store(&P.gen, g); /* seq_cst: ordered before the sleepers load below */
  if (atomic_load(&P.sleepers)) futex_wake_all(&P.gen);
  run_tasks(g);
  long until = 0;
  uint32_t d;
  for (int i = 1; (d = atomic_load_explicit(&P.done, memory_order_acquire)) != (uint32_t)tasks;
       ++i) {
    relax();
    if (i % CLOCK_EVERY) continue;
    long t = now_ns();
    if (!until) {
      until = t + P.spin_ns;
    } else if (t > until) { /* a worker was preempted: sleep until the last task ends */
      atomic_store(&P.caller_sleeping, 1);
      while ((d = atomic_load(&P.done)) != (uint32_t)tasks) futex_wait(&P.done, d);
      atomic_store(&P.caller_sleeping, 0);
      break;
    }
  }
  int failed = atomic_load(&P.failed_task);
  pthread_mutex_unlock(&P.lock);
  if (failed < 0) return 0;
  /* raise the task's error on this thread (TVM reads the caller's last error) */
  TVMParallelGroupEnv env = {NULL, tasks};
  int rc = fn(failed, &env, cdata);
  return rc != 0 ? rc : -1;
}

__attribute__((constructor)) static void register_fork_handler(void) {
  pthread_atfork(NULL, NULL, after_fork_in_child);
}
